"""A run as a whole: opened with its recipe (`Bundle`), trained (`run_training`, `toymlx.train`), summarised, launched over hosts."""
