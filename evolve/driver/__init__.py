"""The driver's side of a run: the generation loop, handing members out to the workers,
checkpoints and the public :class:`~dasktrain.evolve.Evolver`."""
