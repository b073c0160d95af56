"""Live output: the attempt side, the transport, the readers and the browser stream."""
