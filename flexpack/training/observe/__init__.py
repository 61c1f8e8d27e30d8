"""Observability: from training/ only config and observe/; never loop, step, build, plan or run state."""
