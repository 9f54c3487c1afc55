"""Speed modes behind an accuracy guard: lower precision, channels-last, compile, CUDA graphs."""
