"""GET /healthz: the readiness probe of one worker process (503 while it starts or drains)."""
from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from . import worker as worker_module


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 while this worker takes events, 503 while it starts or drains: a load balancer moves clients.

    A sync view on purpose: the first call may build the Worker, whose services can touch the
    database, which Django refuses on the event loop's thread.
    """
    worker = worker_module.get_worker()
    draining = worker.draining
    status = "draining" if draining else "ok" if worker.ready.is_set() else "starting"
    return JsonResponse({"status": status, "worker": worker.id, "draining": draining,
                         "events_in_flight": worker.events_in_flight},
                        status=200 if status == "ok" else 503)
