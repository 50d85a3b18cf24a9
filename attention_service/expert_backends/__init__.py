"""The routed experts from the attention side: the backend seam, the remote backend, placement and links."""
