"""Environments for moolib's toolkit, installed as ``moolib.envs``."""
