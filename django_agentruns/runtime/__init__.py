"""The worker process and one attempt: claiming, running, recording, leases, wake-ups."""
