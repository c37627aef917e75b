"""Labelled real hangs for the diagnosis corpus (tests/test_diagnosis_corpus.py)."""
