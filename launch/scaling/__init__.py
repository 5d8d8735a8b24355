"""The scaling modes of ``moolib-run``, one module each: ``scaling=NAME`` runs what
``moolib.launch.scaling.NAME`` registers (``register_scaling``, in
``moolib.conf.schema.run_config``): its settings' dataclass (the keys of
``conf/scaling/NAME.yaml``), the function that starts a run in that mode, and what the
machine must have for it. A new mode is one module here and its YAML.
"""
