"""The diagnosis rules, one module per family of hangs; the engine runs them in order."""
