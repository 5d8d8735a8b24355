"""Hydra configuration of moolib-run, shipped as package data (``moolib.conf``)."""
