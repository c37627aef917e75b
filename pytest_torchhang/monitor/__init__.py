"""The last resort: a process that acts when the pytest process cannot (``process.py``), the
page that tells it the current deadline (``page.py``) and its pytest-side client (``client.py``)."""
