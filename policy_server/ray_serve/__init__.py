"""``policy_server.v1`` on Ray Serve: replicas (one engine, one GPU each) behind Serve's gRPC proxy, with strict
session affinity.

- ``app``: the Serve application (``import_path: policy_server.ray_serve.app:build_app``) and its arguments;
- ``deployment.PolicyDeployment``: one replica;
- ``call.ServeCall``: what the servicer sees of a call that came through the proxy;
- ``command``: ``policy-server ray-serve``, the application on a local or running Ray cluster.

Needs Ray Serve (``pip install 'policy-server[ray]'``); nothing else in the package imports this one, and this
package imports Ray only in its modules.
"""
