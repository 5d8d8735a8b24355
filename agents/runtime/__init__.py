"""What trains the agents: the runtimes (``onpolicy``: peers that act and learn
data-parallel; ``offpolicy``: actors feeding one learner's replay) and what they
use: checkpoints, logs, the actors' policy slots, a learner's host results."""
