'use strict';
/**
 * relayrl.common.v1.Array <-> plain JS number arrays.
 *
 * protos/common.proto sends bulk arrays as {dtype, length, data} with raw little-endian element bytes,
 * not as repeated scalars. Buffer's explicit *LE readers and writers keep this correct on any host and
 * need no alignment (a received Buffer is often a slice at an odd offset of a pooled ArrayBuffer).
 */

const CODECS = {
  DTYPE_INT32: { size: 4, read: (b, o) => b.readInt32LE(o), write: (b, v, o) => b.writeInt32LE(v, o) },
  DTYPE_INT64: {
    size: 8,
    read: (b, o) => Number(b.readBigInt64LE(o)),
    write: (b, v, o) => b.writeBigInt64LE(BigInt(v), o),
  },
  DTYPE_FLOAT32: { size: 4, read: (b, o) => b.readFloatLE(o), write: (b, v, o) => b.writeFloatLE(v, o) },
  DTYPE_FLOAT64: { size: 8, read: (b, o) => b.readDoubleLE(o), write: (b, v, o) => b.writeDoubleLE(v, o) },
  DTYPE_UINT8: { size: 1, read: (b, o) => b.readUInt8(o), write: (b, v, o) => b.writeUInt8(v, o) },
};

/** An Array message holding `values` as `dtype` (e.g. "DTYPE_INT32"). */
function encodeArray(values, dtype) {
  const codec = CODECS[dtype];
  if (!codec) throw new Error(`encodeArray: unsupported dtype ${dtype}`);
  const data = Buffer.alloc(values.length * codec.size);
  values.forEach((value, i) => codec.write(data, value, i * codec.size));
  return { dtype, length: values.length, data };
}

/**
 * The numbers in an Array message, checked against the dtype the field must have (`expect`).
 * An unset message field (null) or an empty array decodes to [].
 */
function decodeArray(array, expect) {
  if (!array || (array.length === 0 && array.data.length === 0)) return [];
  if (array.dtype !== expect) throw new Error(`decodeArray: expected ${expect}, got ${array.dtype}`);
  const codec = CODECS[expect];
  if (array.data.length !== array.length * codec.size) {
    throw new Error(`decodeArray: ${array.length} x ${expect} needs ${array.length * codec.size} bytes, `
      + `got ${array.data.length}`);
  }
  return Array.from({ length: array.length }, (_, i) => codec.read(array.data, i * codec.size));
}

module.exports = { encodeArray, decodeArray };
