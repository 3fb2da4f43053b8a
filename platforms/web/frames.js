// The binary frames tapml's pages and host exchange (the host side is tapml/platforms/page_bridge.py):
// a 16-byte header -- "TPT1", u32 run id, u32 slot, u32 kind (0 input, 1 const, 2 output), little-endian --
// then the tensor's bytes.

export const FRAME_MAGIC = 0x31545054; // "TPT1" read as little-endian u32
export const HEADER_BYTES = 16;
export const KIND = { input: 0, const: 1, output: 2 };

export function frame(id, slot, kind, bytes) {
  const out = new Uint8Array(HEADER_BYTES + bytes.byteLength);
  const view = new DataView(out.buffer);
  view.setUint32(0, FRAME_MAGIC, true);
  view.setUint32(4, id, true);
  view.setUint32(8, slot, true);
  view.setUint32(12, kind, true);
  out.set(new Uint8Array(bytes.buffer ?? bytes, bytes.byteOffset ?? 0, bytes.byteLength), HEADER_BYTES);
  return out;
}

export function parseFrame(data) {
  const view = new DataView(data);
  if (data.byteLength < HEADER_BYTES || view.getUint32(0, true) !== FRAME_MAGIC) {
    throw new Error("binary frame without a TPT1 header");
  }
  return { id: view.getUint32(4, true), slot: view.getUint32(8, true), kind: view.getUint32(12, true),
           payload: new Uint8Array(data, HEADER_BYTES) };
}
