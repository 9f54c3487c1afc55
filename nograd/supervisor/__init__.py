"""The process supervisor: worker plan, socket hand-off and restarts. Imports no torch."""
