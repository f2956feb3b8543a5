"""HTTP plumbing shared by the server's frontend (entrypoints/) and the router (router/): errors in
OpenAI's shape, JSON/SSE framing, the API-key middleware, the listening socket and log format.

It sits below both so the imports run one way: entrypoints/ -> router/ -> web/, never back up."""
