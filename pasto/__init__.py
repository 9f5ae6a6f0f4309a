"""pasto: learn probabilistic strategic parameters (a mixture over K settings) with PASTO.

The package is the numerical core: objectives, estimators, the exponentiated-gradient update,
exact optimum tools, assignment hashing and a vectorised Monte-Carlo simulator. It does no I/O
and never imports the HTTP service (``service``).
"""

__version__ = "0.1.0"
