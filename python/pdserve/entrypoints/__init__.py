"""How the world reaches pdserve: the CLI, the HTTP server (frontend process) and the offline Engine."""
