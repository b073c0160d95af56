"""What runs attempts: the worker, its executor and the calls an agent makes."""
