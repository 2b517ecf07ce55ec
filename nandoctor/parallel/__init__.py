"""Many ranks of one run: where each rank is (rank_progress), the one supervisor of a launched command
(supervisor), and how ranks agree on a fault, merge their reports and name a rank that died or hung
(distributed)."""
