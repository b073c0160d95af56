"""The worker side: the claim loop, attempts, their writes and leases, and the supervisor."""
