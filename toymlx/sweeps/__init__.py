"""Many runs of one recipe: the spec and its grids, random draws, the supervisor of child processes, the live view, the summary."""
