"""HTTP headers a P/D server and the router both read: a server's current role and registry.

A server that can switch roles (``POST /pd_role_switch``) says on every ``/health`` answer what it
is now, so the router moves it between its prefill and decode sets without asking twice.
"""

ROLE_HEADER = "X-PD-Role"
BOOTSTRAP_PORT_HEADER = "X-PD-Bootstrap-Port"
INSTANCE_HEADER = "X-PD-Instance"  # this run of the server: what the router signs bootstrap fields for
