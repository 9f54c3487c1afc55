"""One call's life in the serving core, whatever front it came by: its key, admission, deadline,
inputs checked, answer."""
