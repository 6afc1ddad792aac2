"""Ray plumbing of the roles: typed handles the driver calls (trainers, rollout engines), the rank workers they
run, the placement group of a run and Ray's start-up. Takes no algorithm decisions: objectives, plans and batches
arrive built."""
