"""The moolib-run launcher and the moolib-plot command, installed as ``moolib.launch``."""
