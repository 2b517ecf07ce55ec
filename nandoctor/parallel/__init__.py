"""Many ranks of one run: where each rank is (rank_progress), and how they agree on a fault, merge
their reports and name a rank that died or hung (distributed)."""
