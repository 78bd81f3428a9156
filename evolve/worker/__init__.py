"""What runs in the workers' processes: a replica of the run's state per process, kept in
step from update records, and the evaluation of members against the fitness."""
