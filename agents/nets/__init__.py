"""The agents' networks: the actor-critic torsos and heads (``models``) and the
Q-networks built on those torsos (``qmodels``)."""
