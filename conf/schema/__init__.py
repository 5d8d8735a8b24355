"""A run's settings as typed, checked dataclasses (``run_config.RunConfig``), the
scaling modes' settings and registry (``scaling``); the checks they share are
``moolib.conf.checks``. The agents' settings are declared by the agents themselves
(``moolib.agents.registry.AgentConfig``).
"""
