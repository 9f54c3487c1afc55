"""nograd's benchmark suite (``make bench``): load driver, baselines, memory and lever studies."""
