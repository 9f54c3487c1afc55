"""The peers the bench measures nograd against: Triton (through PyTriton), TorchServe, infinity.

``envs`` builds each peer's pinned virtual environment, ``servers`` turns a peer into a
``bench.common.Server``, ``protocol`` says how the load generator talks to it, ``check`` holds
its answers to nograd's, ``verify`` runs all of that end to end. The ``*_server.py`` scripts,
``torchserve_handler.py`` and ``peer_models.py`` run inside the peer venvs and import nothing
from nograd or the bench.
"""
