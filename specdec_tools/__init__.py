"""The tools above the services: the `specdec` command (`up`, `generate`,
`models`), the launcher that supervises the three services, and the bench,
load and traces tools. The core (`specdec`) imports nothing from here."""
