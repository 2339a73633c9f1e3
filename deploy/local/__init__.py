"""Services as processes on this machine: the service process, the launcher, the supervisor, node jobs, replicas and scaling, run security."""
