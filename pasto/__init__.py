"""pasto: learn probabilistic strategic parameters (a mixture over K settings) with PASTO.

The package is the numerical core: objectives, estimators, the exponentiated-gradient update,
exact optimum tools, assignment hashing and a vectorised Monte-Carlo simulator. It does no I/O
outside its command-line module (``pasto.cli``) and imports nothing outside itself but numpy and
scipy: never the HTTP service (``service``) nor the client (``pasto_client``); tests/test_layers.py
checks both.
"""

__version__ = "0.1.0"
