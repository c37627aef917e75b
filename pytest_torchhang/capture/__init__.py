"""The cold path, loaded at a test's first fire: read the tree from /proc, take every stack, build the wait-for graph, kill."""
