"""The hang's path, one room: capture -> diagnose -> report -> kill.

Above ``capture/`` (which reads the world) and ``diagnosis/`` (which reads facts), below the
watchdog, the runner and the monitor, which call it. ``reports.py`` is the only place a
``HangReport`` is built (and the headlines the diagnosis does not write: a stall's, a failed
capture's, a follow-up's note); ``path.py`` runs the steps. Nothing is imported here: the
watchdog loads ``path`` at the first fire (the cold path), and ``reports`` alone needs no psutil.
"""
