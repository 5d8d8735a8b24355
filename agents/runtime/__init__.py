"""What trains the agents: the runtimes, each a module named as agents name it
(``onpolicy``: peers that act and learn data-parallel; ``offpolicy``: actors
feeding one learner's replay), the skeleton their learners share (``base``), and
what they use: checkpoints, logs, the actors' policy slots, a learner's host
results. The registry imports a runtime's module when a run needs it, never to
find the agents."""
