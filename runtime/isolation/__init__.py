"""What keeps a sandbox in: cgroups (cgroups.py), user-namespace id ranges
(idmap.py), host-wide budgets (hostlimits.py), the seccomp policy (seccomp.py)
and Landlock (landlock.py), the node's listeners of what they refuse
(denials.py, landlock_audit.py), a container's OCI config (oci.py), and the
spawner that starts the node's programs from a process holding almost no
descriptors (spawner.py)."""
