"""Serve: export folders behind HTTP (``tandem serve EXPORT_DIR``).

    front (app.py, no torch)  --JSON lines over pipes-->  N replica processes (replica.py, torch)

The front validates requests against config.json, queues them (bounded), batches them and hands
each batch to an idle replica (pool.py); a replica that dies mid-batch has its batch put back at
the head of the queue for another replica, and is restarted. This stage reads export folders
(tandem/export/format.py) and imports no training loop. See docs/serve.md.
"""
