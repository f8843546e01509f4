"""The Ray edge: the embedded or joined cluster, the worker group (one actor per GPU slot), drill
injection, and the runner that puts them under a Service. Absolute imports only: `import ray` in
these modules is Ray itself."""
