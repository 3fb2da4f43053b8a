"""Remote devices: ``tapml serve`` (:mod:`.server`), ``remote://`` targets (:mod:`.client`), the wire
protocol (:mod:`.protocol`) and the transport benchmark (:mod:`.bench`)."""
