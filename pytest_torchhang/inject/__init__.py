"""Standard-library-only code that runs in every process of a guarded tree: the start-up hook, the stack dump, progress beats."""
