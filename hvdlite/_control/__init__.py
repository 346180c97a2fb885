"""Control plane: the request queue's work items, negotiation (requests, responses, the
coordinator's table, the response cache and the per-cycle rounds over MPI), fusion planning,
the stall inspector and the failure channel between ranks."""
