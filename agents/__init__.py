"""RL agents on moolib (IMPALA/V-trace, A2C), installed as ``moolib.agents``."""
