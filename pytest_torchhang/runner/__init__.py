"""Subprocess work under a deadline: the fixture object, the runner client, the zygote, the child, the jobs."""
