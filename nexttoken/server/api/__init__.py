"""One module per API the server speaks, each a class of route handlers over the shared serving state
(serving.py)."""
