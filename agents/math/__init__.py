"""The agents' math, apart from networks and runtimes: V-trace (``vtrace``), the
n-step, double-Q, value-rescaling, importance-weight and epsilon-greedy helpers
Ape-X and R2D2 share (``offpolicy``), and Ape-X's and R2D2's own (``apex``,
``r2d2``). Plain torch functions of tensors (and of a network, for the Q-losses)."""
