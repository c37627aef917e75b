"""The fast tier: no torch, no subprocess pytest sessions, seconds (see conftest.py)."""
