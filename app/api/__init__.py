"""HTTP routes: thin translations between protocols and the data plane; no torch here."""
