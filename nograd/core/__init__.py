"""Types and errors every layer shares: tensor datatypes and the serving errors."""
