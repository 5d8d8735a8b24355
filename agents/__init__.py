"""RL agents on moolib (V-trace, A2C, PPO, Ape-X, R2D2), installed as ``moolib.agents``:
one module per agent, with ``math/``, ``nets/`` and ``runtime/`` beside them
(docs/architecture.md, section 7, has the layout)."""
