"""launch: one command from a laptop to many nodes, on torchrun's elastic agent.

``launch(opts, argv, run_dir)`` runs ``python argv...`` on every worker; see launcher.py.
"""
