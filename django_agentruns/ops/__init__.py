"""What operators read and deployments check: metrics, triage, diagnosis, upkeep."""
